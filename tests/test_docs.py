"""The docs name tests as the proof of what they say (docs/ERRORS.md's last column, above all): every test
they name exists, in the file they name it in, so that a renamed or moved test cannot leave a doc pointing
at nothing."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def defined_tests():
    """{test file name: the names of the tests it defines}"""
    return {
        path.name: set(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
        for path in (REPO / "tests").glob("test_*.py")
    }


def test_every_test_the_docs_name_exists_in_the_file_they_name():
    tests, missing = defined_tests(), []
    every = set().union(*tests.values())
    for doc in DOCS:
        for cell in re.findall(r"`[^`]*\btest_\w+[^`]*`", doc.read_text()):
            file = re.match(r"`(?:tests/)?(test_\w+\.py)::", cell)
            for name in re.findall(r"(?<![\w./])(test_\w+)\b(?!\.py)", cell):
                if name not in (tests.get(file[1], set()) if file else every):
                    missing.append(f"{doc.relative_to(REPO)}: {cell}")
    assert len(every) > 200 and not missing, "\n".join(missing)

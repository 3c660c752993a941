"""Text made safe to print: node names and figure names come from the nodes themselves and from files that
anyone may have written (the history), and a terminal acts on the escape sequences and line breaks they may
hold."""


def printable(text) -> str:
    """text with each character a terminal would act on (escape sequences, line breaks, other control
    characters) written as its Python escape instead."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))

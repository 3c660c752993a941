"""The checkpoint: when a run saves (schedule), how it writes and resumes step_<N> folders whole and exact
(checkpointer), the files it checks before anything of them loads (files, safe_load, state_match), what it
sets aside rather than deletes (set_aside), and the exports for transformers (export). It imports common/ and
run/report_figures.py, nothing else of the run: the model an export needs is rebuilt by a function it is
handed."""

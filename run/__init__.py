"""The machinery that operates a training run, one module per job. train.py imports these modules; none of
them imports train.py: what they need of it (its model builder, its step) they are handed as arguments."""

"""What a training run is made of, a package per concept: data/, model/, checkpoint/, progress/ (the run's log
and goodput), health/ (when a run misbehaves), prediction/; and the run's options.py, launch.py and stops.py.
train.py imports them; none imports train.py (run/options.py reads its options from its source)."""

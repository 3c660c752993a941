"""What is trained, and how one step trains it: the model presets and their transformers configs (presets),
the model built for training, wrapped in activation checkpointing, compiled per block and sharded with FSDP2
or replicated with DDP, and its weights initialised or loaded (build), and the training step: the chunked
loss, AdamW, the schedule, clipping (step, loss). train.py trains it; the dry run, the step's prediction,
benchmark.py's timing of the model and sample.py build it from here. It imports nothing of the run's other
packages but the safe loading of weights."""

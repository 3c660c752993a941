"""What train.py's run/ and the benchmark's checks/ share: the GPU datasheet, the node's name and memory,
files written whole, suspects for the job script and one-line errors."""

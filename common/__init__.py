"""What train.py's run/ and the benchmark's checks/ share: the GPU datasheet, the node's name and memory,
files written whole, suspects for the job script, one-line errors and nccl-tests' names and busbw factors of
the collectives."""

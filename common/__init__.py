"""What the scripts share (train.py's run/, sample.py, the benchmark's checks/ and the job): options read from
a script's source, one-line errors, files written whole and read checked, the GPU datasheet, the node's name
and memory, the straggler rules, suspects for the job script, the model folders a user names, nccl-tests'
names and busbw factors of the collectives, and a stopwatch on a device. It imports neither run/ nor checks/,
and torch only inside the functions that need it: the job uses common/ on a python that may lack torch."""

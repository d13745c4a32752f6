"""What a recorded job needs on another machine, each figure with its source.

One sizing for every hand-off target (``torchdoctor sbatch`` / ``handoff --to slurm|ray|
trainjob|pytorchjob|job``): ``recorded`` (the figures a recording holds, read through the
recording summary and the diagnosis), ``size`` (those figures turned into per-node requests:
cores, memory, shared memory, GPUs, ranks, threads, time, network settings), ``command`` (the
training command as torchrun runs it), ``network`` (the settings `doctor` found).
"""

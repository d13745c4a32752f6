"""Hand-off to Slurm: size an sbatch script from a recording, submit it, report on the job.

Layers, each a small module: ``recorded`` (the figures a recording holds, read through the
recording summary and the diagnosis), ``sizing`` (those figures turned into per-node requests,
each with its source), ``script`` (the sbatch text), ``client`` (sbatch/scontrol/sacct run
without a shell), ``status`` (what Slurm and the job's recordings say afterwards).
"""

"""Hand-off to Slurm: an sbatch script from a sized recording, submit it, report on the job.

The sizes come from ``torchdoctor.sizing`` (one definition for every hand-off target). Here:
``script`` (the sbatch text), ``client`` (sbatch/scontrol/sacct run
without a shell), ``status`` (what Slurm and the job's recordings say afterwards).
"""

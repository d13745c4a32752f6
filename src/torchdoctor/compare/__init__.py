"""Two recordings of the same workload side by side: did B get faster or slower than A, by how
much with its uncertainty, which phase of the step moved, and which recorded difference (a
setting, the environment, a busier machine) explains it.

Pure functions over opened recordings and plain data classes (``torchdoctor compare`` prints
them): :mod:`.stats` holds the statistics, :mod:`.runs` reads what a comparison needs from one
recording, :mod:`.verdict` puts two of them side by side.
"""

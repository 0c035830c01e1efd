import os

# Two cores: one intra-op thread per engine keeps OpenMP from spin-waiting against other processes.
os.environ.setdefault("LOCKSTEP_CPU_THREADS", "1")

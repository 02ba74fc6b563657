"""Deployment on clusters: Slurm job scripts (`slurm`), the MPI-aware launcher (`launch`),
readiness probes (`ready`). Submodules import their heavy dependencies lazily."""

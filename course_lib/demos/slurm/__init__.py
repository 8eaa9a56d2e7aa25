"""Slurm batch scripts for the course demos (``torchrun.sbatch``); shipped as package data."""

from gyre_slurm.cli import main

main()

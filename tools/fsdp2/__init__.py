"""make fsdp2-check (tools/fsdp2_check.py, its command line and documentation) in three parts:

    runner.py   the torch venv, the plan of runs, the C run and the FSDP2 run (tools/fsdp2_torch.py)
    read.py     what is read of both runs (the C run's files and trace, FSDP2's records)
    compare.py  the comparisons, and compare_run: both sides of one run and its record
    flat.py     a flat stage (13) against FSDP1 (tools/fsdp1_torch.py), or FSDP2 when the torch has no FSDP1
    report.py   the table and logs/fsdp2/
"""

"""The thin GRPO-family trainer, installed as `fusedrl.trainer` (CLI `fusedrl-train`).

Until the trainer lands, `fusedrl-train` runs the loss demo (`fusedrl.demo`).
"""

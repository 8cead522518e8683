"""Drop-ins for the trainers people already run. Import the one you need:

    from fusedrl.integrations.trl import FusedGRPOTrainer, loss_config_from_trl

Each module imports its trainer library, which fusedrl itself does not depend on.
"""

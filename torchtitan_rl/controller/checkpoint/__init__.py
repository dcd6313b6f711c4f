"""Checkpoints: the trainer's DCP state plus the controller's, and the config a resumed run is
checked against."""

"""Resume: the checkpoint store (staged, atomic writes and the run state), the check before a resume reads a
checkpoint, the trainer's checkpoint room, and the position of the data (sampler and stream) saved with it."""

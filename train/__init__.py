"""splitspec.train: drafter training (MoA, EAGLE-2) by distillation from the target."""

"""Image intake and preprocessing, vision towers, projector and encoder cache."""

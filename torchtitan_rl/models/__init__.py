"""Model definitions and HF <-> torchtitan conversion."""

"""Real models the project ships support for (the embedded default target)."""

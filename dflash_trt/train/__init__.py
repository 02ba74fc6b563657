"""Training DFlash drafters: self-distilled data generation and the DFlash block objective."""

"""Layer 7: converting checkpoints between key forms and file formats, with the writers only conversion uses."""

"""ADP emulator: a software ADP exporting a real NVMe-oF (TCP) target."""

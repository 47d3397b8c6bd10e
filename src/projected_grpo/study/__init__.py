"""Many runs: sweeps over arms and seeds, aggregation, verdicts, report."""

"""The code loophole environment: problems, foolable graders, oracle, detectors, sandbox."""

"""The reward-hacking environment: sandbox, problems, loophole graders, oracle, detectors."""

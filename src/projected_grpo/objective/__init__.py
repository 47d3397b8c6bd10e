"""The objective: advantages, token losses and log-probs, as pure tensor math."""

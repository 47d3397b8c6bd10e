"""The maths environment (seed 003): arithmetic curriculum, GSM8K, a strict verifier and a foolable one."""

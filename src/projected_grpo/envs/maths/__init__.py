"""The maths environment : arithmetic curriculum, GSM8K, a strict verifier and a foolable one."""

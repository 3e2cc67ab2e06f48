"""The toy recipe's kernels and the choice among them: choice.py (its one kernel, "reference", anywhere, and the check
every op call makes), reference.py (that kernel: a plain matmul, each call recorded)."""

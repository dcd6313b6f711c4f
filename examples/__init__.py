"""Example tasks for torchtitan_rl (importable: ``examples.alphabet_sort``)."""

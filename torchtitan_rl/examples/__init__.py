"""Example tasks for torchtitan_rl (importable: ``torchtitan_rl.examples.alphabet_sort``)."""

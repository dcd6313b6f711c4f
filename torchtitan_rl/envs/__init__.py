"""Tasks from the environment libraries the field uses, behind this project's task protocol.

reasoning_gym.py: reasoning-gym's procedural datasets and verifiers (``[task] type = "reasoning_gym"``).
textarena.py: textarena's text games as multi-turn environments (``[task] type = "textarena"``).
Both libraries come with the ``envs`` extra; the library never imports these modules itself.
"""

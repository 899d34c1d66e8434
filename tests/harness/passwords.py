"""The password hasher of the test process: Django's own PBKDF2 with few rounds.

The default (1,000,000 rounds) costs about a second of CPU per user made, and the tests make
hundreds of users: that was most of the suite's CPU. The algorithm's name stays
``pbkdf2_sha256`` and the rounds are stored in each hash, so the processes the tests start
(with the real settings) verify these passwords as they are.
"""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class FewRoundsPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1_000

"""Identity: who is asking and what they may spend.

API keys (``keys``: issued once, stored hashed, checked from an in-process cache), people and
teams with their limits (``people``), what each holder may use and has spent as the pages show
it (``allowances``), the self-service ``/account/`` pages (``account``), the rate and token
limits every request reserves against (``limits``), the counters they are kept in, in Redis or
the store (``counters``), budget counters put right from the ledger (``budgets``), and signing
in: how fast passwords may be tried for one account (``pacing``), one-time sign-in links
(``signin_links``) and the account a single sign-on signs in (``sso_accounts``).
"""

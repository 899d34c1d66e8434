"""The test harness: one way to start and stop real processes, one way to wait for an outcome,
one private Redis, one set of factories. Test modules import from here; nothing here is a test.
"""

"""The ``jobgen`` command line: the composition root, the only room that may import every
other one, and trainer/ and watchdogs/.

``main`` declares the commands and registers the groups of other rooms (``jobgen cluster``,
``jobgen watchdog``); ``common``, ``submit``, ``status``, ``logs``, ``compare``, ``sweep`` and
``serve`` hold the longer command bodies; ``tinymodel`` is ``jobgen make-tiny-model``.
"""

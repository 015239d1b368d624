"""``python -m jobgen.job --settings JSON``: the batch script's supervisor (jobgen.job.supervisor)."""

import sys

from jobgen.job.supervisor import main

sys.exit(main())

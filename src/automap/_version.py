__version__ = "0.1.0"
PLAN_SCHEMA_VERSION = 2
# Plan files this automap still reads: version 1 predates `Plan.zero_gather` (read as
# "params", what those plans ran).
READABLE_PLAN_SCHEMAS = (1, 2)

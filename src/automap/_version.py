__version__ = "0.1.0"
PLAN_SCHEMA_VERSION = 1

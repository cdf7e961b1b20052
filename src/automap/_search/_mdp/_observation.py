"""The DQN's observation: one fixed-size vector for every task, its slots named.

Every task fills the same `OBS_DIM` floats so that one network (and a trained agent warm-
starting another model) serves them all; every first action is valid in `N_ACTIONS`.
The shard task and the staged (pipeline, hybrid) tasks lay the vector out differently
past slot 5: `ShardSlot` and `StagedSlot` name each layout. In the hybrid task both kinds
of state reach one network, so the same slot carries different features there (slot 6:
whether the model axis is outermost, or log S; slot 8: the unit's bytes, or the phase);
the phase one-hot [0:3], set only by the shard task, tells them apart.
"""

from __future__ import annotations

import enum

N_ACTIONS = 8  # enough for the meshes of up to 128 devices, the 3 options and 4 ZeRO stages
OBS_DIM = 26
PER_ACTION = 8  # slots per per-action feature in the staged tasks' vector ([10:18], [18:26])


class ShardSlot(enum.IntEnum):
    """The shard task's observation (`ShardProcess.observation`)."""

    PHASE = 0  # [0:3] one-hot: choosing the mesh, a unit's option, the ZeRO stage
    PROGRESS = 3  # units decided / units
    LOG_DATA = 4  # log2 of the data axis, of the devices
    LOG_MODEL = 5  # log2 of the model axis, of the devices
    MODEL_OUTER = 6  # the model axis is the outer one
    RUNNING_TIME = 7  # the partial plan's step time / the baseline's, clipped at 10, / 10
    UNIT_BYTES = 8  # the next unit: its share of the bytes
    UNIT_FLOPS = 9  # ... of the flops
    UNIT_PARAMS = 10  # ... it holds parameters
    UNIT_BATCH = 11  # ... it holds the batch
    UNIT_POSITION = 12  # ... its position in the program
    DATA_DIVIDES = 13  # ... the data axis divides it
    MODEL_DIVIDES = 14  # ... the model axis divides it
    NEIGHBOURS_DATA = 15  # ... share of its decided neighbours on data
    NEIGHBOURS_MODEL = 16  # ... on model
    NEIGHBOURS = 17  # ... its neighbours / units
    BYTES_SPLIT = 18  # [18:21] the decided bytes kept whole, on data, on model
    UNITS = 21  # units / 256: the size of the problem
    LOG_DEVICES = 22  # log2 devices / 10
    ZERO_ALLOWED = 23  # the space has ZeRO stages
    OVER = 24  # how far over the memory limit the partial plan is, clipped at 10, / 10
    FITS = 25  # the partial plan fits


class StagedSlot(enum.IntEnum):
    """The pipeline and hybrid tasks' observation (`StagedProcess.features`); [0:3] zero."""

    PROGRESS = 3  # decisions taken / decisions of the episode
    LOG_DATA = 4  # log2 of the stage mesh's data axis, of the devices
    LOG_MODEL = 5  # log2 of its model axis, of the devices
    LOG_STAGES = 6  # log2 S, of the devices
    RUNNING_TIME = 7  # (step time / the baseline's + over the limit), clipped at 10, / 10
    PHASE = 8  # (1 + phase) / 7: stages, microbatches, remat, cut, -, sequence par., chunks
    LOG_MICRO = 9  # log2 microbatches / 11
    PER_ACTION_A = 10  # [10:18] a first feature of each action (see each phase)
    PER_ACTION_B = 18  # [18:26] a second feature of each action

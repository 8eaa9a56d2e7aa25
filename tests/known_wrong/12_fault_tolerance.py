"""Shortcuts a learner would try in exercises/12_fault_tolerance.ipynb; each must score zero where listed.

Four gradings (one exercise-1 case each, the cells of a run must differ): a checkpoint without the RNG
states; a "resume" that restarts from scratch (it ends with the right weights, since the run is
deterministic, but redoes every step: the check counts them); the library's own training_state; and a save
straight onto the checkpoint's path (killed halfway through a save, it leaves a broken file where the last
good checkpoint was), next to answers copied from the checking code's frames.
"""
SAVE_LOAD = '''def save_checkpoint(path, model, optimizer, scheduler, sampler, step):
{save}


def load_checkpoint(path, model, optimizer, scheduler, sampler):
{load}
'''
NO_RNG = SAVE_LOAD.format(
    save=("    state = {'step': step, 'model': model.state_dict(), 'optimizer': optimizer.state_dict(),\n"
          "             'scheduler': scheduler.state_dict(), 'sampler': sampler.state_dict()}\n"
          "    torch.save(state, path + '.tmp')\n    os.replace(path + '.tmp', path)"),
    load=("    state = torch.load(path, weights_only=False)\n"
          "    model.load_state_dict(state['model']); optimizer.load_state_dict(state['optimizer'])\n"
          "    scheduler.load_state_dict(state['scheduler']); sampler.load_state_dict(state['sampler'])\n"
          "    return state['step']"))
FROM_SCRATCH = SAVE_LOAD.format(
    save="    torch.save({'step': step}, path)",
    load="    return 0   # start over: the run is deterministic, so the final weights come out right")
LIBRARY = SAVE_LOAD.format(
    save=("    from course_lib.checkpoint import training_state\n"
          "    torch.save(training_state(model, optimizer, step=step, scheduler=scheduler, sampler=sampler), path)"),
    load=("    from course_lib.checkpoint import restore_training_state\n"
          "    return restore_training_state(torch.load(path, weights_only=False), model, optimizer,\n"
          "                                  scheduler=scheduler, sampler=sampler)"))

NEWEST = '''def newest_intact(directory):
{body}
'''
SIZE_ONLY = NEWEST.format(body=(
    "    steps = sorted((int(d.name[5:]), d) for d in Path(directory).glob('step_*') if (d / 'MANIFEST.json').is_file())\n"
    "    for step, d in reversed(steps):\n"
    "        files = json.loads((d / 'MANIFEST.json').read_text())['files']\n"
    "        if all((d / n).is_file() and (d / n).stat().st_size == i['bytes'] for n, i in files.items()):\n"
    "            return step\n"
    "    return None"))
UNVERIFIED = NEWEST.format(body=(
    "    steps = [int(d.name[5:]) for d in Path(directory).glob('step_*') if (d / 'MANIFEST.json').is_file()]\n"
    "    return max(steps) if steps else None"))
MANAGER = NEWEST.format(body=(
    "    from course_lib.checkpoint import CheckpointManager\n"
    "    return CheckpointManager(directory).latest()"))

NOT_ATOMIC = SAVE_LOAD.format(
    save=("    state = {'step': step, 'model': model.state_dict(), 'optimizer': optimizer.state_dict(),\n"
          "             'scheduler': scheduler.state_dict(), 'sampler': sampler.state_dict(),\n"
          "             'rng': (torch.get_rng_state(), np.random.get_state(), random.getstate())}\n"
          "    torch.save(state, path)   # straight onto the last good checkpoint"),
    load=("    state = torch.load(path, weights_only=False)\n"
          "    model.load_state_dict(state['model']); optimizer.load_state_dict(state['optimizer'])\n"
          "    scheduler.load_state_dict(state['scheduler']); sampler.load_state_dict(state['sampler'])\n"
          "    torch.set_rng_state(state['rng'][0]); np.random.set_state(state['rng'][1]); random.setstate(state['rng'][2])\n"
          "    return state['step']"))

# Looks for the expected value in the frames of whoever called it (the check), then in the notebook's globals.
PEEK = '''def _peek():
    import sys
    f = sys._getframe(2)
    while f is not None:
        for name in ("want", "expected", "ref", "best"):
            if name in f.f_locals:
                return f.f_locals[name]
        f = f.f_back
    for name in ("want", "expected"):
        if name in globals():
            return globals()[name]
    raise LookupError("no answer in reach")
'''

INTERVAL = '''def checkpoint_interval(save_seconds, gpu_mtbf_hours, n_gpus):
{body}
'''

CASES = [
    {"name": "saves model, optimizer, scheduler and sampler but not the RNG states",
     "cells": {"ex1-code": NO_RNG}, "zero": ["resume_bitwise"]},
    {"name": "checks the sizes only (a flipped bit keeps the size)",
     "cells": {"ex2-code": SIZE_ONLY}, "zero": ["newest_intact"]},
    {"name": "uses one GPU's MTBF for the whole job",
     "cells": {"ex3-code": INTERVAL.format(body="    return math.sqrt(2 * save_seconds * gpu_mtbf_hours * 3600)")},
     "zero": ["checkpoint_interval"]},
    {"name": "restarts from scratch instead of resuming (right weights, every step redone)",
     "cells": {"ex1-code": FROM_SCRATCH}, "zero": ["resume_bitwise"]},
    {"name": "the newest manifest, without verifying the files",
     "cells": {"ex2-code": UNVERIFIED}, "zero": ["newest_intact"]},
    {"name": "sqrt(delta * M), without Young's factor 2",
     "cells": {"ex3-code": INTERVAL.format(body="    return math.sqrt(save_seconds * gpu_mtbf_hours * 3600 / n_gpus)")},
     "zero": ["checkpoint_interval"]},
    {"name": "course_lib.checkpoint's training_state / restore_training_state",
     "cells": {"ex1-code": LIBRARY}, "zero": ["resume_bitwise"]},
    {"name": "course_lib.checkpoint's CheckpointManager.latest",
     "cells": {"ex2-code": MANAGER}, "zero": ["newest_intact"]},
    {"name": "saves straight onto the checkpoint's path (a kill inside the save breaks the last good one)",
     "cells": {"ex1-code": NOT_ATOMIC}, "zero": ["resume_bitwise"]},
    {"name": "atomic writes through course_lib.checkpoint's private _atomic_write_bytes (not on the old forbid list)",
     "cells": {"ex1-code": SAVE_LOAD.format(
         save=("    import io\n    from pathlib import Path\n    from course_lib import checkpoint\n"
               "    state = {'step': step, 'model': model.state_dict(), 'optimizer': optimizer.state_dict(),\n"
               "             'scheduler': scheduler.state_dict(), 'sampler': sampler.state_dict(),\n"
               "             'rng': (torch.get_rng_state(), np.random.get_state(), random.getstate())}\n"
               "    buf = io.BytesIO(); torch.save(state, buf)\n"
               "    checkpoint._atomic_write_bytes(buf.getvalue(), Path(path))"),
         load=NOT_ATOMIC.split("def load_checkpoint(path, model, optimizer, scheduler, sampler):\n")[1].rstrip("\n"))},
     "zero": ["resume_bitwise"]},
    {"name": "copies the expected value from the check's frames or the notebook's globals",
     "cells": {"ex2-code": PEEK + NEWEST.format(body="    return _peek()"),
               "ex3-code": PEEK + INTERVAL.format(body="    return _peek()")},
     "zero": ["newest_intact", "checkpoint_interval"]},
]

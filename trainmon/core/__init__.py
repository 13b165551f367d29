"""Low-level pieces every layer above uses: hook handles, names, the step schedule, process groups."""

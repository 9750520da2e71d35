"""The forecast made before an option runs, and its check: `runs.py` reads the baseline run (its records), the
option's offline acceptance and the engine's step-cost profile (analysis/speedup/) and writes a forecast run
(`specws.mode=forecast`), then the forecast's error on the measured run that follows; `prior.py` reads the forecast
runs and the measured ones and names the configurations forecast but never measured, for the recommendation."""

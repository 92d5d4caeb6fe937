"""The reports: the JSON documents `check`, `plan`, `trace` and `gpus --model` print, as objects that both faces
render (the command line as rich text, the web page as a page) and a notebook shows as a short table."""

"""The OpenAI Batch API: files of requests run behind interactive traffic, kept on disk.

schemas.py    the file and batch objects (OpenAI's shapes) and the input line
files.py      FileStore: uploaded and produced files under `<batch dir>/files`
multipart.py  an upload's multipart body streamed to disk, size-capped
lines.py      an input file read and checked line by line
results.py    an output file appended line by line, and what it says is done (resume)
job.py        run_lines: the lines of one input through the chat/completions handlers
store.py      BatchStore: each batch's state under `<batch dir>/batches`
runner.py     BatchRunner: the server's service that validates, runs and finalizes batches
offline.py    `mm-engine run-batch -i in.jsonl -o out.jsonl`
"""

import sys

from llmtrain.cli.main import main

sys.exit(main())

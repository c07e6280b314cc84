from llmtrain.cli.main import main

raise SystemExit(main())

from prodrl_pipelines.cli.main import main

raise SystemExit(main())

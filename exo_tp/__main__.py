from exo_tp.cli.main import main

raise SystemExit(main())

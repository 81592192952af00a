from exo_tp.cli.entry import main

raise SystemExit(main())

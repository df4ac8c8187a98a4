from ddpckpt.cli.main import main

raise SystemExit(main())
